"""The server: the long-running owner of requests over a running pipeline (laid out as vLLM's entrypoints).

cli (flags and the uvicorn run: `layerline serve`, `python -m layerline.server`), app (the ASGI
app, its state on app.state), router (the HTTP routes), protocol (request models, OpenAI error
objects), serving (completions and chat over the engine), async_engine (the engine,
layerline.engine, in a thread of its own, fed from asyncio), stages (the stages from a plan or
--first, their control sockets, pipelines into them, health and route switches), route (the
route: ordered active stages and an epoch), failover (health monitor, promotion, switches),
chat (tokenizer, chat template, detokenizing), metrics (Prometheus), auth (API keys).
Nothing heavy is imported here: `from layerline.server import cli` loads argparse only.
"""
