"""Feature interactions: DLRM's pairwise dot (``dot.py``) and DCN's cross layers
(``cross.py``; the DCN-v2 matrix forms' Triton path in ``cross_matrix.py``)."""
