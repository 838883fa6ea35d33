"""GPU kernels written for Carnator where torch's own ops leave most of the card idle (Triton; optional: every caller
falls back to torch when Triton or a GPU is missing, with the same result)."""
