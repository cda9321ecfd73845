"""Two engine replicas on a local Ray cluster, against one in-process engine.

One Ray engine serves the whole module (starting Ray and two actors costs most of the time);
the replica-kill test runs last and also checks that the replacement serves again.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from pagedllm_integrations import SamplingParams  # noqa: E402
from pagedllm_integrations.chat.tool_calls import (  # noqa: E402
    parse_tool_calls,
    tool_call_constraint,
)
from pagedllm_integrations.engine.async_engine import AsyncEngine, RequestError  # noqa: E402
from pagedllm_integrations.engine.config import EngineConfig  # noqa: E402
from pagedllm_integrations.engine.distributed.ray_replicas import RayReplicaEngine  # noqa: E402
from pagedllm_integrations.engine.distributed.router import (  # noqa: E402
    PrefixAwareRouter,
    prefix_block_hashes,
)
from pagedllm_integrations.engine.factory import (  # noqa: E402
    shared_engine,
    shutdown_shared_engines,
)
from pagedllm_integrations.engine.sampling_params import (  # noqa: E402
    RequestOutputKind,
    StructuredOutputsParams,
)

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "The weather today",
    "My favourite colour is",
    "In the beginning",
    "Dear Sir or Madam,",
]
LONG = 300  # tokens per request in the kill test: long enough to kill mid-stream


def _config(folder, **overrides) -> EngineConfig:
    args = dict(model=str(folder), disable_log_stats=True, num_kv_blocks=128, max_model_len=512)
    args.update(overrides)
    return EngineConfig(**args)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy tokens and text of one in-process engine, for short and long requests."""
    with AsyncEngine(_config(tiny_llama_dir)) as engine:
        short = SamplingParams(temperature=0, max_tokens=12)
        long = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
        results = {}
        for name, params in (("short", short), ("long", long)):
            streams = [engine.add_request(p, params) for p in PROMPTS]
            results[name] = [s.result().outputs[0] for s in streams]
    return results


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir):
    config = _config(tiny_llama_dir, data_parallel_size=2, distributed_executor_backend="ray")
    engine = shared_engine(config)  # the hook the integrations go through
    assert isinstance(engine, RayReplicaEngine)
    assert shared_engine(config) is engine
    yield engine
    shutdown_shared_engines()
    assert not ray.is_initialized()  # the engine started Ray, so it stopped it


def test_router_prefers_the_replica_holding_the_prefix():
    router = PrefixAwareRouter(2, block_size=4, max_imbalance=2)
    shared = list(range(100, 116))  # four full blocks
    a, hashes_a = router.choose([*shared, 1, 2])
    router.started(a, hashes_a)
    b, hashes_b = router.choose([7, 7, 7, 7, 8])  # unrelated: the idle replica
    assert b != a
    router.started(b, hashes_b)
    again, _ = router.choose([*shared, 9])
    assert again == a and router.prefix_routed == 1
    assert prefix_block_hashes(shared, 4, 8) == hashes_a  # a partial last block is not hashed
    assert prefix_block_hashes(shared, 4, 8, salt="x")[0] != hashes_a[0]
    # A replica far busier than the least loaded one loses its prefix advantage.
    for _ in range(3):
        router.started(a, [])
    assert router.choose(shared)[0] == b
    router.set_available(b, False)
    assert router.choose([1] * 8)[0] == a
    with pytest.raises(ValueError, match="round_robin"):
        PrefixAwareRouter(2, policy="random")


def test_config_asks_for_the_ray_backend():
    with pytest.raises(ValueError, match="distributed_executor_backend='ray'"):
        EngineConfig(data_parallel_size=2)


def test_replicas_match_a_single_engine(replicas, reference):
    params = SamplingParams(temperature=0, max_tokens=12)
    streams = [replicas.add_request(p, params) for p in PROMPTS]
    outputs = [s.result() for s in streams]
    assert [o.outputs[0].token_ids for o in outputs] == [r.token_ids for r in reference["short"]]
    assert [o.outputs[0].text for o in outputs] == [r.text for r in reference["short"]]
    assert outputs[0].prompt == PROMPTS[0]
    per_replica = replicas.counters.snapshot()["replicas"]
    assert len(per_replica) == 2 and all(r["requests_finished"] > 0 for r in per_replica)
    assert replicas.tokenizer is not None and replicas.max_model_len == 512


def test_async_streaming_and_validation(replicas, reference):
    async def stream_one() -> tuple[str, list[int], int]:
        text, tokens, chunks = "", [], 0
        params = SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.DELTA)
        async for out in replicas.generate(PROMPTS[1], params):
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
            chunks += 1
        return text, tokens, chunks

    text, tokens, chunks = asyncio.run(stream_one())
    assert tokens == reference["short"][1].token_ids and text == reference["short"][1].text
    assert chunks > 1  # streamed, not one final output
    with pytest.raises(ValueError, match="max_model_len"):
        replicas.add_request("word " * 600, SamplingParams(max_tokens=4))


def test_structured_outputs_and_forced_tool_calls_through_replicas(replicas, tiny_llama_dir):
    """Constrained requests are compiled on the driver (issue 16: a model-less front used
    to miss the grammar compiler's lock and raise AttributeError), once: the replicas
    receive the compiled grammar with the request. Replicas must decode them exactly as
    one in-process engine does."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {}}}]
    constraints = [
        StructuredOutputsParams(json=schema),
        StructuredOutputsParams(choice=["yes", "no"]),
        tool_call_constraint(tools, "required"),
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=c) for c in constraints
    ]
    compiled_before = replicas.grammar_compiles
    got = [replicas.add_request(PROMPTS[0], p).result().outputs[0] for p in params]
    # Each constraint compiled once, on the driver: the replicas received it compiled.
    assert replicas.grammar_compiles - compiled_before == len(constraints)
    replica_compiles = ray.get([r.actor.grammar_compiles.remote() for r in replicas._replicas])
    assert replica_compiles == [0] * replicas.num_replicas
    with AsyncEngine(_config(tiny_llama_dir)) as single:
        want = [single.add_request(PROMPTS[0], p).result().outputs[0] for p in params]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    if got[0].finish_reason == "stop":  # the random model may pad with JSON white space
        assert set(json.loads(got[0].text)) == {"ok", "n"}
    assert got[1].text in ("yes", "no") and got[1].finish_reason == "stop"
    _, calls = parse_tool_calls(got[2].text, tools)
    assert [(c.name, c.arguments) for c in calls] == [("ping", {})]


def _on_client_loop(replicas, fn) -> None:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    replicas._loop.call_soon_threadsafe(run)
    assert done.wait(30)


def test_with_no_replica_available_a_request_fails_in_seconds(replicas, reference):
    def down() -> None:
        for index in range(replicas.num_replicas):
            replicas.router.set_available(index, False)

    def up() -> None:
        for index in range(replicas.num_replicas):
            replicas.router.set_available(index, True)
        replicas._available.set()

    _on_client_loop(replicas, down)
    try:
        assert "no replica is available" in (replicas.health() or "")
        with pytest.raises(RequestError, match="no replica is available"):
            replicas.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4)).result()
    finally:
        _on_client_loop(replicas, up)
    assert replicas.health() is None
    params = SamplingParams(temperature=0, max_tokens=12)
    assert replicas.add_request(PROMPTS[0], params).result().outputs[0].token_ids == (
        reference["short"][0].token_ids
    )


def test_a_replica_whose_engine_thread_died_is_replaced(replicas, reference):
    before = replicas.replicas_replaced
    victim = replicas._replicas[1].actor

    def stop_engine_thread(actor) -> None:
        """Runs inside the replica actor (defined here, so Ray ships it by value): its
        engine thread dies, the actor itself stays up and keeps answering."""

        def die() -> None:
            raise SystemExit("injected: the engine thread dies")

        actor.engine._send("call", die)
        # The engine thread runs the command on its own time: return once it has died, so
        # that the health check below sees the death rather than racing it.
        import time as clock

        deadline = clock.monotonic() + 60
        while actor.engine.is_running and clock.monotonic() < deadline:
            clock.sleep(0.01)

    ray.get(victim.__ray_call__.remote(stop_engine_thread))
    assert ray.get(victim.health.remote(60.0))[0] is False  # the actor answers, its engine not
    # Requests keep succeeding: one routed to the dead engine is retried on the other replica.
    params = SamplingParams(temperature=0, max_tokens=12)
    streams = [replicas.add_request(p, params) for p in PROMPTS]
    assert [s.result().outputs[0].token_ids for s in streams] == [
        r.token_ids for r in reference["short"]
    ]
    deadline = time.monotonic() + 300
    while replicas.replicas_replaced == before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert replicas.replicas_replaced == before + 1 and replicas._replicas[1].actor is not victim
    while not all(replicas.router.available) and time.monotonic() < deadline:
        time.sleep(0.5)
    streams = [replicas.add_request(p, params) for p in PROMPTS[:4]]
    assert [s.result().outputs[0].token_ids for s in streams] == [
        r.token_ids for r in reference["short"][:4]
    ]


def _consume(stream, kind, sink: dict, progress: threading.Event, key: int) -> None:
    tokens, text, count = [], "", 0
    try:
        for out in stream:
            c = out.outputs[0]
            if kind == RequestOutputKind.DELTA:
                tokens += c.token_ids
                text += c.text
            else:
                tokens, text = list(c.token_ids), c.text
            count += 1
            if count == 3:
                progress.set()
        sink[key] = (tokens, text, out.outputs[0].finish_reason)
    except Exception as error:  # recorded: the test asserts there is none
        sink[key] = error


def _first_difference(index: int, kind, got: list[int], want: list[int]) -> str:
    """Where a request's tokens leave the reference: enough to tell a seam at the resume
    point from a numerical difference later on."""
    at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (
        f"request {index} ({kind.value}): {len(got)} tokens against {len(want)}, first "
        f"difference at {at}: {got[max(at - 2, 0) : at + 3]} against {want[max(at - 2, 0) : at + 3]}"
    )


def test_save_prefix_through_replicas_writes_what_a_local_engine_then_loads(
    replicas, tiny_llama_dir, tmp_path
):
    with pytest.raises(ValueError, match="prefix_cache_dir"):
        replicas.save_prefix(PROMPTS[0])
    prompt = "You are the helpful assistant of a bicycle shop by the harbour." * 5
    config = _config(
        tiny_llama_dir, data_parallel_size=1, distributed_executor_backend="ray",
        prefix_cache_dir=str(tmp_path),
    )  # fmt: skip
    saving = RayReplicaEngine(config, num_cpus_per_replica=0)  # the others hold the CPUs
    try:
        saved = saving.save_prefix(prompt)
    finally:
        saving.shutdown()
    assert saved >= 3 * 16 and len(list(tmp_path.rglob("*.kv"))) == saved // 16
    params = SamplingParams(temperature=0, max_tokens=6)
    with AsyncEngine(_config(tiny_llama_dir)) as plain:
        expected = plain.add_request(prompt + " Hello", params).result().outputs[0].token_ids
    with AsyncEngine(_config(tiny_llama_dir, prefix_cache_dir=str(tmp_path))) as local:
        output = local.add_request(prompt + " Hello", params).result()
        assert output.outputs[0].token_ids == expected
        assert output.num_cached_tokens == local.scheduler_stats().prefix_cache_disk_loaded > 0


def test_killing_a_replica_mid_run_loses_no_request(replicas, reference):
    replaced_before = replicas.replicas_replaced
    kinds = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
    results: dict[int, object] = {}
    threads, started = [], []
    for i, prompt in enumerate(PROMPTS):
        kind = kinds[i % 3]
        params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True, output_kind=kind)
        progress = threading.Event()
        stream = replicas.add_request(prompt, params)
        thread = threading.Thread(target=_consume, args=(stream, kind, results, progress, i))
        thread.start()
        threads.append(thread)
        started.append((progress, kind))
    for progress, kind in started:  # every streaming request has delivered some tokens
        if kind != RequestOutputKind.FINAL_ONLY:
            assert progress.wait(timeout=120)
    victim = replicas._replicas[0].actor
    ray.kill(victim)
    for thread in threads:
        thread.join(timeout=300)
    for i, ref in enumerate(reference["long"]):
        assert not isinstance(results[i], Exception), results[i]
        tokens, text, finish = results[i]
        assert tokens == ref.token_ids, _first_difference(i, kinds[i % 3], tokens, ref.token_ids)
        assert text == ref.text and finish == "length"
    snapshot = replicas.counters.snapshot()
    assert snapshot["requests_retried"] >= 1
    assert snapshot["requests_resumed"] >= 1  # a stream continued on the other replica
    # The replacement comes up and serves again.
    deadline = time.monotonic() + 300
    while replicas.replicas_replaced == replaced_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert replicas.replicas_replaced == replaced_before + 1
    assert replicas._replicas[0].actor is not victim
    params = SamplingParams(temperature=0, max_tokens=12)
    streams = [replicas.add_request(p, params) for p in PROMPTS[:4]]
    assert [s.result().outputs[0].token_ids for s in streams] == [
        r.token_ids for r in reference["short"][:4]
    ]
    assert all(r["requests_finished"] > 0 for r in replicas.counters.snapshot()["replicas"])
