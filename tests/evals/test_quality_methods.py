"""`servelm eval quality --methods`: a method name may carry int8 activations ('+a8') and a
dtype of its own ('@bfloat16'), so one record compares bfloat16 with the float32 reference."""

import pytest

from servelm.evals.quality import split_dtype
from servelm.quant.int8_act import split_method


def test_method_names_split_into_method_activations_and_dtype():
    assert split_dtype("float32@bfloat16") == ("float32", "bfloat16")
    assert split_dtype("gguf+a8@bfloat16") == ("gguf+a8", "bfloat16")
    assert split_method(split_dtype("gguf+a8@bfloat16")[0]) == ("gguf", "int8")
    assert split_dtype("int8") == ("int8", None)
    with pytest.raises(ValueError, match="after '@'"):
        split_dtype("gguf@fp4")
