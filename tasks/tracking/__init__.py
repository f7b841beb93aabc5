"""MLflow tracking, by concern: `store` (the store, runs, params, dataset inputs), `sink` (metrics during
training, system metrics), `report` (what a finished run shows: evaluation, figures, tables, summary)."""
