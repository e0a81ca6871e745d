"""Small helpers with no loka_train dependencies, shared by every layer (kernels/ to runtime/).

Modules:
    capture: ``reset_capture_state`` (after a failed CUDA graph capture); ``after_replay``
        (host work that runs after every replay of the graph it was captured in).
    profiling: ``profiled`` (profiler ranges that cost nothing when no profiler runs).
    names: ``strip_wrapper_prefixes`` (module names without DMP / DDP wrapper prefixes).
    config_keys: ``unknown_key_message`` (a misspelled setting and the nearest valid ones).
    console: ``TABLE``, ``is_table`` (log records that are tables for the terminal).
"""
