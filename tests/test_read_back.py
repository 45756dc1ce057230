"""The step's one read-back (`specdec_fast.batch.read_back`) against a hand-made batch of trees.

Two rows of five nodes: row 0 a tree with a padded node whose path (root, 2, 3) was accepted,
row 1 a chain that was rejected at once. What comes back per row: the next token, the accepted
count, the accepted node indices and their tokens (picked on the host from the tree's), the
drafted nodes (padding and root excluded), the tree's depth, and the flagged rows.
"""

import torch

from specdec_fast.batch import read_back
from specdec_fast.drafters.base import PAD_PARENT, Proposal
from specdec_fast.kernels.verify import VerifyResult

P = PAD_PARENT
TOKENS = torch.tensor([[7, 11, 12, 13, 0], [8, 21, 22, 23, 24]])
PARENTS = torch.tensor([[-1, 0, 0, 2, P], [-1, 0, 1, 2, 3]])
DEPTHS = torch.tensor([[0, 1, 1, 2, 0], [0, 1, 2, 3, 4]])
RESULT = VerifyResult(
    torch.tensor([[0, 2, 3, -1, -1], [0, -1, -1, -1, -1]], dtype=torch.int32),
    torch.tensor([2, 0], dtype=torch.int32),
    torch.tensor([14, 30]),
)


def test_a_tree_step_reads_back_paths_sizes_and_depths():
    host = read_back(Proposal(TOKENS, PARENTS), RESULT, DEPTHS).wait()
    assert host.next_tokens == [14, 30]
    assert host.num_accepted == [2, 0]
    assert host.nodes == [[2, 3], []]
    assert host.paths == [[12, 13], []]
    assert host.drafted == [3, 4]
    assert host.depths == [2, 4]
    assert host.malformed == []


def test_flagged_rows_come_back_with_the_step():
    malformed = torch.tensor([False, True])
    host = read_back(Proposal(TOKENS, PARENTS, malformed=malformed), RESULT, DEPTHS).wait()
    assert host.malformed == [1]
    assert host.paths == [[12, 13], []]
    plain = Proposal(TOKENS[:, :1], PARENTS[:, :1], malformed=malformed)
    result = VerifyResult(
        RESULT.accepted_nodes[:, :1], torch.zeros(2, dtype=torch.int32), RESULT.next_tokens
    )
    host = read_back(plain, result, DEPTHS[:, :1]).wait()
    assert host.next_tokens == [14, 30] and host.malformed == [1]
    assert host.num_accepted == host.drafted == host.depths == [0, 0]
