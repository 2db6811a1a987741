"""Calibration of the two path transforms, layer by layer, and export of a fused checkpoint.

content.py  R (orthogonal) and sigma on attention-output reconstruction
rope.py     per-pair phi and alpha on positional QK reconstruction
driver.py   the layer-by-layer loop: capture one decoder layer's inputs, calibrate, fold, move on
export.py   write / read a checkpoint with the transforms fused and a `quantmla` config section
streaming.py  the same for checkpoints larger than memory: one decoder layer's weights resident at a time
"""
