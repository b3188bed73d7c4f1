"""Sampling from models: the continuous-batching rollout engine (engine.py: scheduler, paged KV-cache
manager, runner, sampler, detokenizer; async_engine.py for the server) with vLLM's request and sampling
parameters (params.py) and structured outputs (structured.py), and the plain reference generator the
engine is tested against (reference_generator.py)."""
