"""How prompts are cut into prefill messages (plain constants: the server's flags read them without torch).

CHUNK: prompt tokens a prefill message carries; BUSY_CHUNK: the same while other sequences decode, since
such a chunk delays every decode step queued behind it. 32 kept the p99 inter-token gap at 16 streaming
clients within 2x llama-server's on SmolLM2 Q4_1 (64: 2.2x; 1.9x once stages shared cores a micro-batch a
core), for 0-10% less aggregate (docs/serving.md).
"""
CHUNK = 128
BUSY_CHUNK = 32
