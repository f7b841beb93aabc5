"""Flows compose the stages of `tasks/` and validate their one pydantic config; no training logic here."""
