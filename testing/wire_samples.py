"""One hand-built instance of every wire message: the golden-bytes test pins their encoding."""

from llmbus.bus import messages as m

SAMPLING = m.SamplingParams(temperature=0.5, top_k=10, top_p=0.9, typical_p=1.0, do_sample=True, seed=42,
                            repetition_penalty=1.1, frequency_penalty=0.2, top_n_tokens=2, watermark=False,
                            presence_penalty=0.5, min_p=0.05, frequency_per_count=True)
STOPPING = m.StoppingParams(max_new_tokens=20, stop_token_ids=[2], ignore_eos=False)
GRAMMAR = m.Grammar(kind="json_schema", source='{"type": "object", "properties": {"a": {"type": "integer"}}}')

SAMPLES: dict[m.Kind, m.Message] = {
    m.Kind.FRONTEND_HELLO: m.FrontendHello("f0", "ipc:///tmp/llmbus-x/events-f0.sock"),
    m.Kind.ADD_REQUEST: m.AddRequest("f0-1", "f0", [1, 300, 301], SAMPLING, STOPPING, True, 1700000000.5,
                                     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", GRAMMAR,
                                     "sql-expert"),
    m.Kind.HEALTH_CHECK: m.HealthCheck("f0", 3, 5.0),
    m.Kind.FRONTEND_STATS: m.FrontendStats("f1", 10, 8, ["validation"], [2], ["duration"],
                                           [m.Histogram([0.01, 0.1], [1, 6, 1], 0.4)], ["/v1/messages"], [10],
                                           ["", "sql-expert"], [7, 3]),
    m.Kind.HEALTH_PROBE: m.HealthProbe(9),
    m.Kind.HEALTH_ACK: m.HealthAck(rank=1, probe_id=9),
    m.Kind.HEALTH_REPLY: m.HealthReply(3, False, "rank 1 did not answer within 5 s"),
    m.Kind.ABORT_REQUEST: m.AbortRequest(["f0-1", "f0-2"]),
    m.Kind.STEP: m.StepCommand(
        step_id=7, new_requests=[m.NewRequestData("f0-2", SAMPLING, [4, 5, 8], 36, False, list(range(16)),
                                                         GRAMMAR, "sql-expert")],
        rids=["f0-1", "f0-2"], num_computed=[33, 16], num_new=[1, 20], token_ids=[m.SAMPLED_LAST] + list(range(20)),
        sample=[True, True], added_blocks=[["f0-1", [6]]], finished_rids=["f0-0"], ahead=True),
    m.Kind.SHUTDOWN: m.Shutdown("scheduler stopped"),
    m.Kind.STEP_RESULT: m.StepResult(7, ["f0-1", "f0-2"], [11, 12], [-0.25, -1.5], 0.01, 0.001,
                                     [[[11, 13], [-0.25, -2.0]], [[12, 14], [-1.5, -1.75]]],
                                     [["f0-1", [-1.25, -0.5], [[[5, 9], [-0.75, -1.25]], [[7, 9], [-0.5, -1.5]]]],
                                      ["f0-2", [-2.0], []]],
                                     [["f0-2", "generation", "grammar state lost: no token at position 40"]],
                                     request_state=6),
    m.Kind.WORKER_HELLO: m.WorkerHello(rank=1, world_size=2, pid=4242),
    m.Kind.WORKER_READY: m.WorkerReady(rank=0, num_blocks=1024, block_size=16, dtype="bfloat16", device="cpu",
                                       max_position_embeddings=2048, warmup_step_s=0.75, warmup_step_tokens=256,
                                       vocab_size=49152, attention_backend="triton", onednn_cache_capacity=64,
                                       lora_adapters=["sql-expert", "poet"], rope_split_tokens=4096),
    m.Kind.WORKER_FATAL: m.WorkerFatal(rank=1, error="RuntimeError: boom"),
    m.Kind.SCHEDULER_HELLO: m.SchedulerHello(max_batch_total_tokens=16384, block_size=16, dtype="bfloat16",
                                             attention_backend="triton", devices=["cuda:0", "cuda:1"],
                                             lora_adapters=["sql-expert", "poet"]),
    m.Kind.SCHEDULER_STATS: m.SchedulerStats(queue_size=3, batch_size=5, batch_max_tokens=1024,
                                             kv_blocks_total=512, kv_blocks_free=448, block_size=16,
                                             kv_blocks_cached=40, prefix_cache_queried_tokens=4000,
                                             prefix_cache_hit_tokens=1600, preemptions=2, prefill_steps=30,
                                             decode_steps=400, concat_chunking=12, concat_backpressure=0,
                                             concat_wait_exceeded=0,
                                             prefill_forward=m.Histogram([0.01, 0.1], [3, 25, 2], 1.75),
                                             decode_forward=m.Histogram([0.01, 0.1], [300, 100, 0], 4.5),
                                             prefill_duration=None, decode_duration=None,
                                             next_batch_size=m.Histogram([1.0, 2.0, 4.0], [20, 6, 4, 0], 46.0),
                                             worker_restarts=1, onednn_cache_capacity=64,
                                             worker_request_state=6, prefix_cache_heap_entries=84),
    m.Kind.TOKEN_BATCH: m.TokenBatch(["f0-1", "f0-2"], [11, 12], [-0.25, -1.5], [0, 1], prompt_logprobs=[
        ["f0-1", [-1.25, -0.5], [[[5, 9], [-0.75, -1.25]], [[7, 9], [-0.5, -1.5]]]]]),
    m.Kind.REQUEST_FAILED: m.RequestFailed("f0-3", "validation", "empty prompt"),
    m.Kind.ENGINE_DEAD: m.EngineDead("worker rank 1 failed: RuntimeError: boom"),
    m.Kind.SERVICE_READY: m.ServiceReady("frontend", 4243, "http://0.0.0.0:3000"),
    m.Kind.SERVICE_FATAL: m.ServiceFatal("scheduler", 4244, "EngineFailure: step 3 got no result"),
    m.Kind.RESTART_SERVICE: m.RestartService("workers", 4244, "worker rank 0 disconnected: its process died"),
}
