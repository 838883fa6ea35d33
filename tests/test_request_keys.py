"""Request keys hash tensors where they lie, as the same float32 bytes the keys of earlier stores were made of."""
import hashlib

import torch

from carnator_engine.fingerprint import hash_values
from carnator_engine.hosts.conditioning import conditioning_fingerprint


def test_tensors_are_hashed_in_place_as_the_float32_bytes_that_earlier_stores_were_keyed_by():
    generator = torch.Generator().manual_seed(0)
    positive = [[torch.randn(1, 7, 16, generator=generator).to(torch.bfloat16), {"strength": 0.5}]]
    negative = [[torch.randn(1, 7, 16, generator=generator)[:, :, ::2], {}]]     # a strided view
    for tensor in (positive[0][0], negative[0][0], torch.randn(3, 5, generator=generator)):
        ours, copied = hashlib.sha256(), hashlib.sha256(tensor.float().contiguous().numpy().tobytes())
        hash_values(ours, tensor)
        assert ours.hexdigest() == copied.hexdigest()
    # the request key of a stored generation: a store written before answers its exact repeats still
    assert conditioning_fingerprint(positive, negative, 3) == \
        "9285c495b71beeb6811759a41261ae7787cfe804bf0a21ba806c0df62fcf76a3"
