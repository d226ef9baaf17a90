"""`specroute bench`: methods side by side on Spec-Bench prompts (runner, records, report)."""
