"""The hybrid student: the Gated DeltaNet mixer, the transformers-native model, the conversion, the export."""
