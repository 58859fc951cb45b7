"""``bench.soak.producer_records``: what the producers' files say they generated. A group goes to
the outbox log before its send and to the sent log after, so a producer killed between the two
sent a group only its outbox log records: it still counts, once."""

from __future__ import annotations

import json

import numpy as np

from bench.soak import producer_records
from buffer.schema import Completion, RolloutGroup
from pipeline.producer.outbox import Outbox

INC = "p1-77-123"


def _group(seq: int, position: int) -> RolloutGroup:
    c = Completion(token_ids=np.array([1, 2], np.int32), logprobs=np.array([-1, -2], np.float32),
                   version_segments=[(0, 0)], reward=1.0)
    return RolloutGroup(group_id=f"{INC}-{seq}", producer_id="p1", prompt_id=str(seq),
                        prompt_token_ids=np.array([5], np.int32), completions=[c, c],
                        metadata={"incarnation": INC, "seq": seq, "position": position})


def test_a_group_sent_but_not_yet_in_the_sent_log_counts_once_from_the_outbox_log(tmp_path):
    box = Outbox(tmp_path, "p1", INC, max_groups=100)
    for seq in (0, 1, 2):  # 0 and 1 sent and logged; 2 sent, killed before its sent-log line
        box.add(_group(seq, position=10 + seq))
    box.close()
    rows = [{"seq": 0, "group_id": f"{INC}-0", "position": 10},
            {"seq": 1, "group_id": f"{INC}-1", "position": 11},
            {"dropped_by_reward": f"{INC}-x", "prompt_id": "9"}]
    (tmp_path / f"{INC}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    rec = producer_records(tmp_path)
    assert rec.produced == {INC: {0, 1, 2}}
    assert rec.in_outbox == {(INC, 0), (INC, 1), (INC, 2)}
    assert rec.positions == {10: 1, 11: 1, 12: 1}  # each group's prompt read once
    assert rec.dropped == {"dropped_by_reward": 1, "dropped_zero_variance": 0,
                           "dropped_restart": 0}


def test_without_an_outbox_log_the_sent_log_alone_counts(tmp_path):
    (tmp_path / f"{INC}.jsonl").write_text(json.dumps({"seq": 4, "position": 2}) + "\n"
                                           + json.dumps({"dropped_restart": "g"}) + "\n")
    rec = producer_records(tmp_path)
    assert rec.produced == {INC: {4}} and rec.in_outbox == set()
    assert rec.positions == {2: 1} and rec.dropped["dropped_restart"] == 1
