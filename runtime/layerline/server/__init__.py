"""The server: the long-running owner of requests over a running pipeline.

api (FastAPI app, routes, request models), scheduler (the generation engine in its own
thread), chat (tokenizer, chat template, detokenizing), metrics (Prometheus), auth (API keys),
cli (flags and the uvicorn run: `layerline serve`, `python -m layerline.server`).
Nothing heavy is imported here: `from layerline.server import cli` loads argparse only.
"""
