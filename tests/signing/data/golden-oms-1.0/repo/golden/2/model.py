# golden model, version 2
