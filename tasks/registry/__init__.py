"""What the registry holds of a llamaflow model: `pyfunc.py`, the MLflow pyfunc logged as code."""
