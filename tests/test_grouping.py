import pytest
import torch

from compressor.math.grouping import consecutive_kl, group_layers, local_maxima
from compressor.runtime.errors import UserError


def test_kl_of_identical_distributions_is_zero_and_positive_otherwise():
    p = torch.softmax(torch.randn(4, 10, dtype=torch.float64), dim=-1)
    p[2] = p[1]
    kl = consecutive_kl(p)
    assert kl.shape == (3,)
    assert kl[1].abs() < 1e-12
    assert (kl[[0, 2]] > 0).all()


def test_local_maxima_count_sequence_ends():
    assert local_maxima(torch.tensor([5.0, 1.0, 2.0, 1.0, 3.0])) == [0, 2, 4]


def test_paper_pattern_first_and_last_layers_become_singletons():
    # Large KL at the first and last transitions, as measured on SmolLM2 and reported for Llama 3.2 1B.
    kl = torch.tensor([9.0, 1.0, 0.5, 0.8, 0.4, 0.3, 7.0])
    grouping = group_layers(kl, 3, end_boundaries=True)
    assert grouping.groups == [[0], [1, 2, 3, 4, 5, 6], [7]]
    assert grouping.boundaries == [0, 6]


def test_without_end_boundaries_no_singleton_at_the_ends():
    kl = torch.tensor([9.0, 1.0, 0.5, 0.8, 0.4, 0.3, 7.0])
    grouping = group_layers(kl, 3, end_boundaries=False)
    assert len(grouping.groups[0]) > 1 and len(grouping.groups[-1]) > 1
    assert sum(grouping.sizes) == 8
    # the only interior local maximum (index 3) is used; the rest is filled by the largest values
    assert 3 in grouping.boundaries


def test_groups_partition_all_layers_consecutively():
    kl = torch.rand(11, generator=torch.Generator().manual_seed(1))
    for g in range(1, 13):
        grouping = group_layers(kl, g)
        flat = [layer for group in grouping.groups for layer in group]
        assert flat == list(range(12)) and len(grouping.groups) == g


def test_impossible_group_count_is_a_user_error():
    with pytest.raises(UserError, match="--groups 20"):
        group_layers(torch.rand(5), 20)
