"""The P/D handover contract: one typed `Handover`, and the one rule for whether a prefilled
request continues on a decode worker (its blocks leased) or ends on the prefill worker."""

from __future__ import annotations

import pytest
from baton.services.engine import SamplingParams
from baton.services.engine.api.handover import Handover, KVPath, can_disaggregate, continues_after_prefill
from baton.services.engine.config import EngineConfig
from baton.services.engine.engine_core import EngineCore
from baton.services.engine.errors import InvalidRequestError
from baton.services.kv_transfer.types import KVTransferParams
from baton.services.roles import Role

PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def prefill_engine(llama_dir):
    engine = EngineCore(EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=32, block_size=16, role="prefill"))
    yield engine
    engine.shutdown()


def prefill(engine: EngineCore, request_id: str, **params):
    engine.submit(
        engine.prepare(request_id, PROMPT, SamplingParams(temperature=0, **params), handover=Handover.prefill())
    )
    for _ in range(100):
        for output in engine.step():
            if output.finished:
                return output
    raise AssertionError("prefill did not finish")


def drain(engine: EngineCore) -> None:
    """Lets the runner see the lease ends, then checks every block came back."""
    for _ in range(5):
        engine.step()
    engine.check_integrity()


def test_a_request_that_goes_on_leases_its_blocks(prefill_engine):
    out = prefill(prefill_engine, "goes-on", max_tokens=8, ignore_eos=True)
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    kv = out.kv_transfer_params
    assert kv is not None and kv.num_tokens == len(PROMPT) and kv.transfer_id == "goes-on"
    assert prefill_engine.stats().num_kv_leases == 1
    prefill_engine.scheduler.handover.release("goes-on")  # what a finished send does
    drain(prefill_engine)
    assert prefill_engine.stats().num_free_kv_blocks == prefill_engine.num_kv_blocks


@pytest.mark.parametrize("ending", ["user's limit", "stop token"])
def test_a_request_that_ends_at_its_first_token_holds_no_lease(prefill_engine, ending):
    if ending == "stop token":
        probe = prefill(prefill_engine, "probe-token", max_tokens=1)
        params, finish_reason = dict(max_tokens=8, stop_token_ids=list(probe.token_ids)), "stop"
    else:
        params, finish_reason = dict(max_tokens=1), "length"
    out = prefill(prefill_engine, f"ends-{ending}", **params)
    assert out.finish_reason == finish_reason and out.kv_transfer_params is None
    assert prefill_engine.stats().num_kv_leases == 0
    drain(prefill_engine)
    assert prefill_engine.stats().num_free_kv_blocks == prefill_engine.num_kv_blocks


def test_a_stop_string_on_the_first_token_gives_the_lease_back(prefill_engine):
    first = prefill(prefill_engine, "probe", max_tokens=1)
    text = prefill_engine.tokenizer.decode(first.token_ids)
    assert text, "the probe's first token must decode to text"
    out = prefill(prefill_engine, "stopped", max_tokens=8, stop=[text])
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == text
    assert out.kv_transfer_params is None
    assert prefill_engine.stats().num_kv_leases == 0
    drain(prefill_engine)
    assert prefill_engine.stats().num_free_kv_blocks == prefill_engine.num_kv_blocks


def test_several_samples_cannot_be_handed_over(prefill_engine):
    with pytest.raises(InvalidRequestError, match="one sample"):
        prefill_engine.prepare("n2", PROMPT, SamplingParams(n=2), handover=Handover.prefill())
    with pytest.raises(InvalidRequestError, match="one sample"):
        prefill_engine.prepare(
            "beam", PROMPT, SamplingParams(use_beam_search=True, beam_width=2), handover=Handover.prefill()
        )


def test_the_rules():
    assert can_disaggregate(SamplingParams())
    assert not can_disaggregate(SamplingParams(n=2))
    assert not can_disaggregate(SamplingParams(use_beam_search=True, beam_width=2))
    assert continues_after_prefill(max_tokens=8, num_output_tokens=1, stopped=False)
    assert not continues_after_prefill(max_tokens=1, num_output_tokens=1, stopped=False)
    assert not continues_after_prefill(max_tokens=8, num_output_tokens=1, stopped=True)


def test_a_handover_names_what_is_missing():
    kv = KVTransferParams("t", "w@0", (), (0,), 16, 16, 1)
    assert Handover.decode([5], kv).is_decode and Handover.prefill().is_prefill
    with pytest.raises(ValueError, match="tokens generated before it"):
        Handover(Role.DECODE, (), kv)
    with pytest.raises(ValueError, match="carries no tokens"):
        Handover(Role.PREFILL, (5,), None)
    with pytest.raises(ValueError, match="colocated request has no handover"):
        Handover(Role.COLOCATED)
    assert KVPath("prefill-only") is KVPath.PREFILL_ONLY
