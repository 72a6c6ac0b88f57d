"""The OpenAI-compatible server: a scheduler with continuous batching over a Runner, the HTTP API, the Ray Serve app."""
