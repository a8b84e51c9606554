"""Other tools' surfaces over meshkit's Engine: each has an Engine and answers with that tool's names and meanings
(`accelerate/`: `meshkit.Accelerator`). Nothing below this layer imports it."""
