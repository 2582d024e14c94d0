"""The request side, pure host code: validate a System One body (protocol), render it to token ids and
spans (records, tokenizer), and shape answers from probabilities (answers). No torch here."""
