"""Grammar-constrained decoding on the GPU (skipped on CPU): the mask is filled in pinned host memory and
applied to the logits on the device after a CUDA-graph decode step; with NextN speculation on, batches with
a grammar request decode plainly. The unconstrained request of a batch keeps its tokens (against the same
batch without the grammar); the constrained one is JSON valid for its schema."""

import json

import jsonschema
import pytest
import torch

from engine.engine import Engine
from engine.grammar.spec import GrammarSpec
from engine.sampling import SamplingParams
from tests.speculative.helpers import SPEC

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FLAGS = dict(model="tiny-py", device="cuda", dtype="bfloat16", max_total_tokens=16384, max_running_requests=16,
             cuda_graph_bs="1,2,4,8,16")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
SPEC_JSON = GrammarSpec("json_schema", json.dumps(SCHEMA))


def _run(eng, jobs):
    reqs = [eng.make_request(ids, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True), grammar=g)
            for ids, n, g in jobs]
    for r in reqs:
        eng.scheduler.add(r)
    return eng.run_until_done(reqs)


@pytest.mark.parametrize("spec", [False, True], ids=["graphs", "graphs+nextn"])
def test_constrained_next_to_unconstrained(spec):
    eng = Engine(**FLAGS, **(SPEC if spec else {}))
    free_ids, json_ids = [5, 17, 99, 3, 42, 8, 77], [7, 33, 101, 58, 12]
    others = [(free_ids[:3], 8, None)] * 6
    free, constrained = _run(eng, [(free_ids, 32, None), (json_ids, 64, SPEC_JSON)] + others)[:2]
    # the same batch, step for step (the second row unconstrained but as long): the first row's tokens agree
    reference = _run(eng, [(free_ids, 32, None), (json_ids, len(constrained.token_ids), None)] + others)[0]
    assert free.token_ids == reference.token_ids
    assert constrained.finish_reason == "stop"
    jsonschema.validate(json.loads(eng.tokenizer.decode(constrained.token_ids)), SCHEMA)
