"""The live dashboard: GET /dashboard (a static page shipped in the package) polling GET /v1/stats.

Everything it shows is built from what the front end already receives (one StepOutput per engine step) and
from the server's own Prometheus metrics: serving it never asks the engine for anything.
"""
