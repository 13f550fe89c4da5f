"""Looking at the frames that will train: each row's training window is decoded small and measured, so that
hard cuts, black or frozen clips, letterbox and pillarbox bars and near-duplicate rows are found before a run.

Window -> measures -> duplicates:

- ``window.py``: which frames train (the training's frame selection) and decoding just those, small;
- ``measures.py``: the statistics of one window (cut, black, motion, bars, perceptual hashes) and the findings;
- ``duplicates.py``: near-duplicate rows from their perceptual hashes, across the whole catalogue;
- ``measure_store.py``: the measures of earlier runs, so an unchanged row is not decoded again;
- ``run_inspection.py``: every row's window measured in parallel worker processes, with progress;
- ``contact_sheet.py``: an HTML page of the flagged rows' frames, to judge the findings by eye.
"""
