"""The hybrid student: the Gated DeltaNet mixer (its maths in torch alone, shipped by the `hf` export, and tcal's
layer over it), the transformers-native model, the conversion, the export."""
