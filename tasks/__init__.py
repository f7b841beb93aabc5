"""The pipeline's stages, one module per stage; each is a plain function that Prefect wraps."""

from tasks.settings import apply_environment_defaults

apply_environment_defaults()
