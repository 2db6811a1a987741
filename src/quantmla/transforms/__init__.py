"""Transforms of the two cache paths, as pure functions on vectors and as exact folds into the weights.

Content: c' = sigma * R c_hat (R orthogonal dc x dc, sigma > 0 per channel, c_hat = latent before gamma).
RoPE:    per frequency pair j, k' = M_j k with M_j = alpha_j Rot(phi_j); queries get M_j^{-T}. M_j commutes
         with RoPE's rotation, so q_pe . k_pe is unchanged at every position.
Folding them is free at run time: the cache then simply holds c' and k'.
"""

from quantmla.transforms.content import ContentTransform, apply_content, fold_content
from quantmla.transforms.rope import RopeTransform, apply_rope_transform, fold_rope, pair_matrices

__all__ = ["ContentTransform", "RopeTransform", "apply_content", "apply_rope_transform", "fold_content",
           "fold_rope", "pair_matrices"]
