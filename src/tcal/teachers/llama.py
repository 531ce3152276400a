"""Llama family (Llama-3.x, SmolLM2): no attention biases unless `attention_bias` is set."""

from tcal.teachers import register
from tcal.teachers.base import TeacherAdapter

LLAMA = register(TeacherAdapter(family="llama", model_types=("llama",),
                                dropped=("q_proj.bias", "k_proj.bias", "v_proj.bias")))
