"""Recipes: short scripts that compose tasks, models, objectives, samplers and the trainer."""
