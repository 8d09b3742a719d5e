"""Tasks and rewards: the W1 `add` generator (`add`), prompt streams and the verl Parquet loader (`data`),
reward functions and their resolution from `module:function` (`rewards`)."""
