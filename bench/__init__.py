"""`llmbus bench`: a load generator for any TGI- or OpenAI-compatible server."""
