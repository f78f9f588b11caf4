"""The deploy stages, one module each; deploy.py calls them in order."""
