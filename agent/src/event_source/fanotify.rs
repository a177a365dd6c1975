//! The fanotify event source.
