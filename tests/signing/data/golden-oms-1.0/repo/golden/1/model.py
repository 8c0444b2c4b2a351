# golden model, version 1
