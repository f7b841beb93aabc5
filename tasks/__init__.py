"""The pipeline's stages, one module per stage, each a plain function that Prefect wraps:
`tokenize`, `dataset`, `build`, `train`, `evaluate`, `register`.

Beside them: `refs` (the typed references that travel between stages), `home` (where llamaflow keeps
things), `lookup` (registered models back as PyTorch modules), and the stages' helpers in folders:
`data/` (corpora, files, caches), `training/` (the engine: plain PyTorch, runnable under torchrun),
`tracking/` (MLflow runs, metrics, reports), `registry/` (the MLflow pyfunc).
"""
