"""Dense <-> MoE conversion and weight-name maps (`t5`: T5 <-> Seq2Seq-MoE)."""
