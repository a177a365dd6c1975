//! The inotify event source.
