"""Reading and writing parameters: sharded and full state dicts, where each
rank's piece lies (boxes), DCP checkpoint files, pretrained loading, meta init."""
