"""OpenAI-compatible HTTP server over the service (FastAPI + uvicorn)."""
