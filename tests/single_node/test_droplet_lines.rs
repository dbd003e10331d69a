//! `TAKE` and `QUERY` on the divvy line protocol over real sockets: the
//! droplet model with line answers (`OK <accept> ls=<n> …`), pipelined
//! transcripts, accrual on a manual clock, and `ERR` for bad arguments.

use crate::util;

use tollgate::clock::Clock;
use util::droplet::DropletTestServer;

#[test]
fn a_pipelined_transcript() {
    let clock = util::manual_clock();
    let server = DropletTestServer::start(clock.clone());
    let answers = server.line.converse(
        b"TAKE bucket=x ls=10 lm=100\n\
          TAKE bucket=x ls=10 count=9\n\
          TAKE bucket=x ls=10\n\
          QUERY bucket=x\n\
          HIT method=GET path=/status\n\
          TAKE bucket=x ls=2 reset=true\n\
          QUERY bucket=x\n\
          QUERY bucket=unknown id=q1\n\
          take bucket=x count=-5 ls=10\n\
          TAKE \"bucket\"=\"a b\" lh=1 id=r-1\n\
          TAKE bucket=\"a b\" lh=1\n\
          TAKE bucket=x lw=7 lo=30 ld=3 count=0\n",
    );
    let expected = "OK true ls=9 lm=99\n\
                    OK true ls=0\n\
                    OK false ls=-1\n\
                    OK true ls=0 lm=90\n\
                    OK true 999 60\n\
                    OK true ls=1\n\
                    OK true ls=1\n\
                    OK true\n\
                    OK true ls=6\n\
                    OK true lh=0\n\
                    OK false lh=-1\n\
                    OK true ld=3 lw=7 lo=30\n";
    assert_eq!(answers, expected);
}

#[test]
fn tokens_accrue_between_lines() {
    let clock = util::manual_clock();
    let server = DropletTestServer::start(clock.clone());
    let mut stream = server.line.connect();
    assert_eq!(
        util::request(&mut stream, "TAKE bucket=t ls=4 count=4"),
        "OK true ls=0"
    );
    assert_eq!(
        util::request(&mut stream, "TAKE bucket=t ls=4"),
        "OK false ls=-1"
    );
    clock.advance_ms(249);
    assert_eq!(
        util::request(&mut stream, "TAKE bucket=t ls=4"),
        "OK false ls=-1"
    );
    clock.advance_ms(1);
    assert_eq!(
        util::request(&mut stream, "TAKE bucket=t ls=4"),
        "OK true ls=0"
    );
    clock.advance_ms(1_000);
    assert_eq!(util::request(&mut stream, "QUERY bucket=t"), "OK true ls=4");
    // Full, it is forgotten at the next cleanup tick (a multiple of 60 s).
    let next_tick_ms = 60_000 - clock.now_ms() % 60_000;
    clock.advance_ms(next_tick_ms - 1);
    assert_eq!(util::request(&mut stream, "QUERY bucket=t"), "OK true ls=4");
    clock.advance_ms(1);
    assert_eq!(util::request(&mut stream, "QUERY bucket=t"), "OK true");
}

#[test]
fn bad_arguments_get_err_and_close_the_connection() {
    let server = DropletTestServer::start(util::manual_clock());
    let cases = [
        ("TAKE ls=1\nTAKE bucket=a\n", "ERR unknown \"TAKE needs bucket=<name>\"\n"),
        (
            "TAKE bucket=a ls=1\nTAKE bucket=a count=x\nTAKE bucket=a ls=1\n",
            "OK true ls=0\nERR unknown \"count must be an integer from -2147483648 to 2147483647, got 'x'\"\n",
        ),
        (
            "QUERY bucket=a extra=1\n",
            "ERR unknown \"unknown QUERY argument 'extra' (expected bucket, id)\"\n",
        ),
        (
            "TAKE bucket=a ls=99999999999\n",
            "ERR unknown \"ls must be an integer from 0 to 4294967295, got '99999999999'\"\n",
        ),
        ("TAKE bucket\n", "ERR unknown \"Unexpected end of input string.\"\n"),
    ];
    for (input, expected) in cases {
        assert_eq!(server.line.converse(input.as_bytes()), expected, "{input}");
    }
    // The bad line's neighbours were not executed: bucket `a` holds what the
    // one good take left.
    assert_eq!(server.line.converse(b"QUERY bucket=a\n"), "OK true ls=0\n");
}
