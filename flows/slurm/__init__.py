"""Pretraining as a SLURM batch job: `python -m flows.slurm CONFIG.yaml --nodes N --gpus-per-node G
[--submit]` prints (or submits with sbatch) a batch script in which every node of the allocation runs
`python -m flows.slurm.node` once (`script.py` writes it, `node.py` is what each node runs).

Node 0 runs the pretrain flow (data stages, its own torchrun, evaluation, registration) and hosts the
rendezvous store at its own address; the other nodes wait for it in the shared run directory
(`tasks.training.join`). The run directory (`checkpoint_dir`) is the same for every submission of one
configuration, so a resubmission resumes from the newest checkpoint and continues the same MLflow run.
"""
