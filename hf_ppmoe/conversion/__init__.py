"""Checkpoint converters (see DESIGN.md, "Conversion"); `megatron.py`: HF <-> Megatron-LM weights."""
