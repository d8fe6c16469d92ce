"""MatchRule.deepest (its fast path, run on every match and, through the tree's `_dead`,
on every leaf eviction looks at) against its definition: the last True of `resumable`."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowradix.layout.spec import KVLayout, PoolSpec, Retention
from shadowradix.tree.rules import MatchRule


@st.composite
def rules(draw: st.DrawFn) -> MatchRule:
    ps = draw(st.sampled_from([1, 2, 4, 8]))
    pools = [PoolSpec(f"all{i}", 1, Retention.ALL, (2,), "float32", 1)
             for i in range(draw(st.integers(0, 2)))]
    for i in range(draw(st.integers(0, 2))):  # windows of one page and wider
        pools.append(PoolSpec(f"win{i}", 1, Retention.WINDOW, (2,), "float32", 1,
                              window=draw(st.integers(1, 3 * ps + 1))))
    pools += [PoolSpec(f"state{i}", None, Retention.CHECKPOINT, (3,), "float32", 1)
              for i in range(draw(st.integers(0, 2)))]
    if not pools:
        pools.append(PoolSpec("all", 1, Retention.ALL, (2,), "float32", 1))
    return MatchRule.of(KVLayout("rule", tuple(pools), ps))


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(rule=rules(), data=st.data())
def test_deepest_is_the_last_resumable_boundary(rule: MatchRule, data: st.DataObject) -> None:
    rows = len(rule.all_rows) + len(rule.windows) + len(rule.checkpoint_rows)
    m = data.draw(st.integers(0, 12))
    present = np.array(data.draw(st.lists(st.booleans(), min_size=rows * m,
                                          max_size=rows * m)), dtype=bool).reshape(rows, m)
    pages = np.where(present, 7, -1).astype(np.int32)
    ok = rule.resumable(pages)
    assert ok[0] and ok.size == m + 1
    assert rule.deepest(pages) == int(np.flatnonzero(ok)[-1])
