#!/bin/bash
# llamaflow: /tmp/pytest-of-root/pytest-221/test_bad_input_is_refused_befo2/run.yaml on 2 node(s); resubmit to resume from the newest checkpoint
#SBATCH --job-name=llamaflow-tiny
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --output=runs/x/slurm-%j.out
#SBATCH --open-mode=append
set -euo pipefail
cd /work/wt/slurm
# Every node runs its part: node 0 the pretrain flow (it hosts the rendezvous), the others wait for it.
# One node failing ends them all. The environment is the submitter's (sbatch's default).
srun --kill-on-bad-exit=1 --ntasks-per-node=1 /work/wt/slurm/.venv/bin/python -m flows.slurm.node /tmp/pytest-of-root/pytest-221/test_bad_input_is_refused_befo2/run.yaml --nnodes 2 --nproc-per-node 8 --checkpoint-dir runs/x
