"""Qwen2 / Qwen2.5 family: q/k/v projections carry biases, which the GDN drops."""

from tcal.teachers.base import TeacherAdapter

QWEN2 = TeacherAdapter(family="qwen2", dropped=("q_proj.bias", "k_proj.bias", "v_proj.bias"))
