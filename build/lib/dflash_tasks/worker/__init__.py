"""The GPU worker process around its tasks: Celery hooks (start, connect, stop), the circuit
breaker in front of its SGLang server, the heartbeat, the server's /metrics sampler, the warm
shutdown, and the broker transport that keeps it alive through Redis restarts."""
