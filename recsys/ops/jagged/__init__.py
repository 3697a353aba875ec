"""Ops on jagged sequences: HSTU's pointwise attention (``attention.py``, its Triton path
``attention_triton.py`` and tile helpers ``attention_tiles.py``), per-sequence concatenation
(``concat.py``) and the dense add of positional rows (``dense_add.py``)."""
