"""Media files as training reads them: decoding the frames that train, which frames, probing sizes, shape keys."""
