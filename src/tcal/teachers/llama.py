"""Llama family (Llama-3.x, SmolLM2): no attention biases unless `attention_bias` is set."""

from tcal.teachers.base import TeacherAdapter

LLAMA = TeacherAdapter(family="llama", dropped=("q_proj.bias", "k_proj.bias", "v_proj.bias"))
