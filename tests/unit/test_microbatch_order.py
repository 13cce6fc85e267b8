"""The loader's row order gives each microbatch of the step's split the same rows on every layout."""
import numpy as np
import pytest

from jaxcolossal.parallel.microbatch_order import microbatch_order


@pytest.mark.parametrize("rows,n,k", [(16, 1, 2), (16, 4, 2), (16, 8, 2), (24, 2, 3), (8, 4, 1)])
def test_each_microbatch_is_a_consecutive_slice(rows, n, k):
    order = microbatch_order(rows, n, k)
    assert sorted(order) == list(range(rows))
    split = order.reshape(n, k, rows // (n * k))  # the step's [data shard, microbatch, rows]
    for j in range(k):
        assert sorted(split[:, j].reshape(-1)) == list(range(j * rows // k, (j + 1) * rows // k))
    if n == 1 or k == 1:
        assert list(order) == list(range(rows))


def test_rows_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="10 rows do not split into 4 data shards x 2 microbatches"):
        microbatch_order(10, 4, 2)
