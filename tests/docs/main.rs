//! The documentation, run as written: every shell block of README.md,
//! docs/*.md and the other READMEs is executed against real `tollgate`
//! processes on free ports, so that docs and behaviour cannot drift apart
//! unnoticed. `blocks` reads the Markdown; `test_shell_blocks` runs it.

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod blocks;
mod test_shell_blocks;
