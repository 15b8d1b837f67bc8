"""Histogram buckets, in seconds (latencies) or counts."""

# time to first token, queue time: a step to minutes
REQUEST_LATENCY_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# end-to-end: up to an hour
E2E_LATENCY_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0)
# per token, per step, per round trip: sub-millisecond to seconds
STEP_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
          0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
# gRPC calls: a unary call to a long-lived stream
CALL_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
          10.0, 30.0, 60.0, 300.0, 1800.0, 7200.0)
# rows of a drafter window, sequences in a draft batch
COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
# tokens of one request (prompt, generation): 1-2-5 steps to a million
TOKENS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5)) + (1_000_000,)
