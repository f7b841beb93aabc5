"""`python -m model`: print the preset table (parameters and training FLOPs/token at sequence length 1024)."""

from model.config import describe_presets

if __name__ == "__main__":
    describe_presets(seq_len=1024, print_table=True)
