"""The stage process: holds a layer range, takes activations in, sends activations on.

    python -m layerline.worker --checkpoint DIR --layers A:B --device D --precision P
        --kv-context N --kv-dtype T --rng-seed S --bind ADDR --next ADDR [--first] [--last]
        --keys DIR [--next-key HOST] [--curve auto|on] [--name HOST] [--ready-file PATH]
        [--control ADDR] [--threads N] [--spin N] [--awake-ms MS] [--compile off|default|max-autotune]
        [--compile-cache DIR]
    python -m layerline.worker --probe [--checkpoint DIR] [--device D]

By job: cli (argv, priority, main), sockets (ZeroMQ, CURVE), control (the control protocol:
health, stats, set_next, shutdown), stage (the layers, their KV pool, step timing, the forward of
one message), serve (the process: the loop between sockets and compute). The KV cache contract
is layerline.model.kv's KVPool. Torch-free at import, so `python -m layerline.worker` sets the
OpenMP environment before torch loads.
"""
from .cli import control_endpoint, lower_priority, main, openmp_env, parse_args

__all__ = ["control_endpoint", "lower_priority", "main", "openmp_env", "parse_args"]
